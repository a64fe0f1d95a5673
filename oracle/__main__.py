from oracle.cli import main

main()
