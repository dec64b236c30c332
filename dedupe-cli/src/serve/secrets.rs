//! Signing secrets of `dedupe serve`, by route: from `--secret` (visible to
//! `ps`), from `--secret-file`, and from `DEDUPE_SECRET_<ROUTE>` variables.

use std::collections::HashMap;
use std::path::PathBuf;

use dedupe_core::Error;

/// Every configured secret, by route name (`standard` for /hooks, a provider,
/// a named route), in the order given.
pub fn collect(
    flags: &[String],
    files: &[PathBuf],
    routes: &[&str],
) -> Result<HashMap<String, Vec<String>>, Error> {
    let mut out: HashMap<String, Vec<String>> = HashMap::new();
    let known = |name: &str| name == "standard" || routes.contains(&name);
    let mut add = |spec: &str, from: &str| -> Result<(), Error> {
        let spec = spec.trim();
        let (route, secret) = match spec.split_once('=') {
            Some((name, value)) if known(name) => (name, value),
            Some((name, _))
                if !name.is_empty()
                    && name.len() < 40
                    && !name.contains(['_', ' '])
                    && !name.starts_with("whsec") =>
            {
                return Err(Error::config(format!(
                    "{from}: {name} is not a route (routes: standard, {})",
                    routes.join(", ")
                )))
            }
            _ => ("standard", spec),
        };
        if secret.is_empty() {
            return Err(Error::config(format!("{from}: empty secret for {route}")));
        }
        let route = if route == "hooks" { "standard" } else { route };
        out.entry(route.to_string())
            .or_default()
            .push(secret.to_string());
        Ok(())
    };
    for flag in flags {
        add(flag, "--secret")?;
    }
    for path in files {
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::config(format!("--secret-file {}: {e}", path.display())))?;
        for line in text.lines() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            add(line, &format!("--secret-file {}", path.display()))?;
        }
    }
    let mut vars: HashMap<String, &str> = HashMap::new();
    for route in routes.iter().copied().chain(["standard"]) {
        let var = format!(
            "DEDUPE_SECRET_{}",
            route.to_ascii_uppercase().replace(['-', '.'], "_")
        );
        if let Some(other) = vars.insert(var.clone(), route) {
            return Err(Error::config(format!(
                "routes {other} and {route} both read {var}: rename one"
            )));
        }
        if let Ok(value) = std::env::var(&var) {
            for secret in value.split_whitespace() {
                add(&format!("{route}={secret}"), &var)?;
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_files_and_names() {
        let dir = tempfile::tempdir().expect("dir");
        let file = dir.path().join("secrets");
        std::fs::write(&file, "# rotation\nbilling=whsec_b1\n\nwhsec_plain\n").expect("write");
        let routes = ["hooks", "stripe", "billing"];
        let got = collect(
            &["stripe=whsec_s".into(), "billing=whsec_b0".into()],
            &[file],
            &routes,
        )
        .expect("secrets");
        assert_eq!(got["stripe"], ["whsec_s"]);
        assert_eq!(got["billing"], ["whsec_b0", "whsec_b1"]);
        assert_eq!(got["standard"], ["whsec_plain"]);
        assert!(collect(&["nowhere=abc".into()], &[], &routes).is_err());
        assert!(collect(&["stripe=".into()], &[], &routes).is_err());
        assert!(collect(&[], &["/nonexistent/secrets".into()], &routes).is_err());
        assert!(collect(&[], &[], &["billing-eu", "billing.eu"]).is_err());
    }
}
