"""The in-process engine: every actor's state machine wired in one process, on the fake runner or a tiny model."""
