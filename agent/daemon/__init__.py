"""The host daemon: the Unix-socket server, one client connection, follow streams, the connect bridge."""
