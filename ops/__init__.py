"""Operations tooling: benchmarks and trace replay (bench/), answer quality (quality/), monitoring assets."""
