"""Secondary tiers behind one contract (tiers.base), the page format and store admin."""
