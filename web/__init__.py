"""eaglewatch web UI: FastAPI app, Jinja2 templates and Server-Sent Events (presentation only)."""
