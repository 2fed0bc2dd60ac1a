"""The user's world as a step function reaches it: found, lent stand-ins for the call, left as it was.

:mod:`.reaching` walks what the function can reach; :mod:`.journal` records each
mutable object on the way and puts it back after the call; :mod:`.standins`
makes the stand-ins and lends them to the world for the call; :mod:`.watching`
refuses what the call touches that the walk did not reach.
"""

from pytest_torchmem.engine.world.watching import UnfollowedError

__all__ = ["UnfollowedError"]
