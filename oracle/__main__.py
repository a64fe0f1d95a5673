from oracle.program import oracle_main

oracle_main()
