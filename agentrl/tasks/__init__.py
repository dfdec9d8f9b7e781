"""Tasks: the YAML format (`spec`, `load`), the imported formats (`terminal/` for
Terminal-Bench and Harbor folders, `swe/` for SWE-bench-style rows), one door to all of
them (`formats.load_any`), and the runtime and graders that play and grade an instance
(`env`, `graders`)."""
