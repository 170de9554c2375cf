from bigbatch.cli.main import console

console()
