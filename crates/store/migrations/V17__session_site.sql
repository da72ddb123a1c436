-- ttlab schema, version 17: every session records its site, the place its VMs run.
--
-- A site is one cluster's API server and a namespace in it. Without a sites file a backend
-- has one site, `default`, so every row written before this version, and every row a
-- backend without sites writes, is on `default`. The name follows `SiteName`: a lowercase
-- DNS label (letters, digits and '-', starting and ending with a letter or digit) of at
-- most 40 characters, so the database never holds a site the model cannot read.

ALTER TABLE sessions ADD COLUMN site text NOT NULL DEFAULT 'default'
    CONSTRAINT sessions_site_check
    CHECK (length(site) <= 40 AND site ~ '^[a-z0-9]([-a-z0-9]*[a-z0-9])?$');
