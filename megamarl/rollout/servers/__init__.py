"""Engine server processes: one server's command line and lifecycle (``server_launch``) and the run's
servers on every rank (``fleet.ServerFleet``: start, watchdog, address exchange, start-up checks).
Imports ``rollout.engines`` and ``rollout.weights`` (the transport a server is started with)."""
