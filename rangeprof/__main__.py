from rangeprof.cli import app

app(prog_name="rangeprof")
