"""c10d backends bundled with the harness, each registered when its module is imported."""
