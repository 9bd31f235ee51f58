"""Sluice: the `sluice` command line. The packages live in gateway/, policies/, backend/,
telemetry/ and loadtest/; this package only dispatches to them."""
