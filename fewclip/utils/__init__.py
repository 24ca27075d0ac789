"""The ground floor: errors, file I/O, checksums, randomness, logging, progress, locks, the registry."""
