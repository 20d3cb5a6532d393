"""The omniscale CLI, demo data, trainer entry, benchmarks and reports."""
