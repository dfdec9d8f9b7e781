"""`agentrl serve-tinker`: the Tinker training API (tinker SDK 0.38.0) over agentrl's own
learner (FSDPBackend) and sampler (LocalSampler).

The layout follows a request: `server` takes the HTTP call, `service` owns sessions,
models and sampling sessions, `futures` orders each model's operations and holds their
results until the client polls them, `learner` runs a training operation with Tinker's
semantics, `checkpoints` keeps what save_state writes, `sampling` samples a weights
snapshot, and `wire` converts protobuf payloads.
"""
