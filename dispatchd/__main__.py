from dispatchd.cli import main

raise SystemExit(main())
