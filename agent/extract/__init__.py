"""The extraction job: vLLM hidden-state capture (worker extension or vLLM-native), writer, tiny models."""
