"""Router: several vLLM-compatible servers behind one Sampler, and the control plane over them.

- `routing.py`, the data plane: `Router`, which replica serves each request (sessions
  stick to one), failover to another when one goes down, and continuation of replies a
  publication cut short.
- `control.py`, the control plane: pause (abort / wait / keep), sleep, the weights
  version, publication (checkpoint reload, or vLLM's weight-transfer protocol over
  gloo / NCCL), quarantine of replicas that miss a version, the health check.
- `replica.py`: what both know about each server, and the control routes' HTTP client.

Exact versions. A request sent after a publication is stamped with the new version.
Pause mode `abort` (the default) returns in-flight requests cut short; the router
sends the rest of each one again (prompt + tokens so far) once the new weights are in,
so the first part carries the old version and the rest the new one, on any server.
Mode `keep` leaves requests parked on the server across the update, so only a server
that reports each token's version can stamp them (agentrl serve does, vLLM does not):
the router refuses `keep` otherwise. Mode `wait` drains them first.
"""

from agentrl.inference.router.routing import Router

__all__ = ["Router"]
