"""GPU benchmarks (run on the H200 machine; results in benchmarks/NOTES.md)."""
