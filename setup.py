"""Build hook for the optional C accelerator of the OTLP span encoder (telemetry/_otlp.c).

Everything else is in pyproject.toml. The extension is optional: without a C compiler the
install goes on and telemetry.otlp uses its pure-Python encoder (same bytes, slower).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("telemetry._otlp", ["telemetry/_otlp.c"], optional=True,
                             extra_compile_args=["-O2"])])
