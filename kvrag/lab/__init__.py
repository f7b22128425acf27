"""The harness, out of the library's way: the study (study/), the benchmarks (bench/), the demo, the synthetic
worlds and the roofline the benchmarks measure against."""
