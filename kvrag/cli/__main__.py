from kvrag.cli.main import app

app()
