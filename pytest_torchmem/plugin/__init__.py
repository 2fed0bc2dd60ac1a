"""The pytest plugin: hooks (which only delegate), the session, verdicts, snapshot files, the summary, hookspecs."""
