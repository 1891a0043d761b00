from tfmem_magic.adapters.cli import main

raise SystemExit(main())
