"""xtrain's wing."""
