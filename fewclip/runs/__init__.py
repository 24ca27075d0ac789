"""Runs: one run and its record, launchers, sweeps."""
