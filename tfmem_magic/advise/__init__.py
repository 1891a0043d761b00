"""What the report advises: predictions (what-if), calibration probes, findings and fix cells."""
