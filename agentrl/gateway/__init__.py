"""Bring your own agent: an OpenAI-compatible gateway that records an external agent
harness's model calls as token-exact trajectories (`recorder`), its HTTP side
(`server`), and the episodes such a harness plays (`external`)."""
