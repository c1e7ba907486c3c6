"""The actor runtime without a whole group: shells, transports, ports, logging, polling, threads."""
