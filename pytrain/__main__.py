from pytrain.cli import main

raise SystemExit(main())
