"""What is true of the machine: processes, GPU holders, run process sets (no notion of agent or supervisor)."""
