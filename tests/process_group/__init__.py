"""Real process groups: supervision, crashes, sockets and their security, TP and replica sets."""
