"""Starting and driving vLLM for a capture: engine arguments, runtime gates, native backend, canary."""
