"""eaglewatch agent: the GPU-host daemon, its pure cores (protocol, rules, outputs) and the extraction job."""

__version__ = "0.1.0"
