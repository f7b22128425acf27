"""What every test run shares: the user's config folder (where kvrag keeps the user's key, `kvrag.cache.secret`) is a
temporary one, so tests neither read nor make the key of the user who runs them. Processes the tests start inherit
it."""

import os
import tempfile

os.environ["XDG_CONFIG_HOME"] = tempfile.mkdtemp(prefix="kvrag-test-config-")
