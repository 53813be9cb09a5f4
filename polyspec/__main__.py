from polyspec.cli import main

raise SystemExit(main())
