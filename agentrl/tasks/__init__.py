"""Tasks: the YAML format, importers for Terminal-Bench/Harbor and SWE-bench, graders."""
