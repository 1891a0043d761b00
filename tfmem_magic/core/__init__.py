"""The report, sizes and errors: the contract every layer shares. Imports nothing else of tfmem_magic."""
