"""What one server process shares across its calls: the engines (models, playbooks, LLM client),
the call registry (admission, rate limits, building sessions), metrics, traces and logs."""
