"""The estimate engine: the step driver, stand-ins, tracing with one rule set per device, measurement, the report."""
