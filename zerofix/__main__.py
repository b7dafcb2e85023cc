from zerofix.cli import main

raise SystemExit(main())
