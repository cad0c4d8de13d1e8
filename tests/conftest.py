"""Settings every test starts from."""

import os

# The classifier child's default (auto) depends on the CPUs of the machine: the suite runs the rules in
# the daemon wherever it runs, and the tests that name the child turn it on (tests/agent/test_classifier.py).
os.environ.setdefault("EAGLEWATCH_AGENT_CLASSIFIER", "off")
