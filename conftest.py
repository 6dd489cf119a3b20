"""Repository-wide pytest configuration: the tests of the harness run inner pytest sessions."""

pytest_plugins = ["pytester"]
