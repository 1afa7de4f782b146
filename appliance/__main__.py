"""`python -m appliance ...` is `appliance ...`."""

from appliance.cli import main

raise SystemExit(main())
