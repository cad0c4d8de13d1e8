"""Log files: the pure line splitter and the offset reader with inotify wake-ups."""
