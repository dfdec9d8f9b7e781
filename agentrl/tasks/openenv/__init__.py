"""OpenEnv environments as tasks: a folder with `openenv.yaml` (its server's code and
Dockerfile, as OpenEnv publishes them) is a task whose sandbox runs the environment's
server, whose tools are its actions and whose rewards are its steps' (`load`, `env`,
`session`, `image`)."""
