"""Benchmarks, one command: `eagle-serve bench NAME [args]` (`eagle-serve bench --help` lists
them). Each runs configurations interleaved and writes JSON and a plot where asked."""
