"""polyspec.export: profile, verdicts, chain folder export and serving (issue: pipeline end to end). Not implemented yet."""
