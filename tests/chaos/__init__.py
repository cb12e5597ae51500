"""The chaos suite: real workers, real SIGKILL, real network faults (make chaos)."""
