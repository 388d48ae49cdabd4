from profiler.cli import app

app(prog_name="rangeprof")
