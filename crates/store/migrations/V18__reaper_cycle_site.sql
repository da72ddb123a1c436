-- ttlab schema, version 18: a reaper cycle records the site it ran on.
--
-- A reaper runs one schedule per site (a cluster's API server and a namespace in it), so a
-- cycle report belongs to one site. Rows written before this version, and rows recorded
-- without a site, have none (NULL). The name follows `SiteName`, as `sessions.site` does.

ALTER TABLE reaper_cycles ADD COLUMN site text
    CONSTRAINT reaper_cycles_site_check
    CHECK (site IS NULL OR (length(site) <= 40 AND site ~ '^[a-z0-9]([-a-z0-9]*[a-z0-9])?$'));
