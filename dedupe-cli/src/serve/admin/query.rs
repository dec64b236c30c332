//! The filter of the admin surface, as query or form fields: the same names
//! in the JSON API and in the dashboard's forms.

use std::time::Duration;

use dedupe_core::{ItemFilter, ItemStatus};
use serde::Deserialize;
use serde_json::{json, Value};

/// `state`, `error`, `ordering_key`, `min_attempts`, `max_attempts`,
/// `older_than_secs`, `newer_than_secs`; an empty field (as an HTML form
/// sends it) is no condition.
#[derive(Debug, Default, Clone, Deserialize)]
pub(crate) struct FilterFields {
    #[serde(default, deserialize_with = "text")]
    pub(crate) state: Option<String>,
    #[serde(default, deserialize_with = "text")]
    pub(crate) error: Option<String>,
    #[serde(default, deserialize_with = "text")]
    pub(crate) ordering_key: Option<String>,
    #[serde(default, deserialize_with = "text")]
    pub(crate) min_attempts: Option<String>,
    #[serde(default, deserialize_with = "text")]
    pub(crate) max_attempts: Option<String>,
    #[serde(default, deserialize_with = "text")]
    pub(crate) older_than_secs: Option<String>,
    #[serde(default, deserialize_with = "text")]
    pub(crate) newer_than_secs: Option<String>,
}

/// A field as text: a string (a query or a form), or a JSON number or null.
fn text<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    struct Text;
    impl serde::de::Visitor<'_> for Text {
        type Value = Option<String>;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a string, a whole number or null")
        }
        fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
            Ok(Some(v.to_string()))
        }
        fn visit_u64<E>(self, v: u64) -> Result<Self::Value, E> {
            Ok(Some(v.to_string()))
        }
        fn visit_i64<E>(self, v: i64) -> Result<Self::Value, E> {
            Ok(Some(v.to_string()))
        }
        fn visit_unit<E>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_none<E>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
    }
    d.deserialize_any(Text)
}

fn given(field: &Option<String>) -> Option<&str> {
    field.as_deref().map(str::trim).filter(|v| !v.is_empty())
}

fn number<T: std::str::FromStr>(name: &str, field: &Option<String>) -> Result<Option<T>, String> {
    given(field)
        .map(|v| {
            v.parse::<T>()
                .map_err(|_| format!("{name}: {v:?} is not a whole number"))
        })
        .transpose()
}

impl FilterFields {
    /// The filter over `namespace` these fields say; the error names the
    /// field that is wrong.
    pub(crate) fn filter(&self, namespace: &str) -> Result<ItemFilter, String> {
        let mut filter = ItemFilter::new(namespace);
        filter.status = given(&self.state)
            .map(|s| {
                s.parse::<ItemStatus>().map_err(|_| {
                    format!("state: {s:?} is not one of pending, running, failed, dead")
                })
            })
            .transpose()?;
        filter.error = given(&self.error).map(str::to_string);
        filter.ordering_key = given(&self.ordering_key).map(str::to_string);
        filter.min_attempts = number("min_attempts", &self.min_attempts)?;
        filter.max_attempts = number("max_attempts", &self.max_attempts)?;
        filter.older_than =
            number("older_than_secs", &self.older_than_secs)?.map(Duration::from_secs);
        filter.newer_than =
            number("newer_than_secs", &self.newer_than_secs)?.map(Duration::from_secs);
        filter.validate().map_err(|e| e.to_string())?;
        Ok(filter)
    }

    /// The fields of `filter`, to carry it from one page to the next.
    pub(crate) fn of(filter: &ItemFilter) -> Self {
        Self {
            state: filter.status.map(|s| s.as_str().to_string()),
            error: filter.error.clone(),
            ordering_key: filter.ordering_key.clone(),
            min_attempts: filter.min_attempts.map(|n| n.to_string()),
            max_attempts: filter.max_attempts.map(|n| n.to_string()),
            older_than_secs: filter.older_than.map(|d| d.as_secs().to_string()),
            newer_than_secs: filter.newer_than.map(|d| d.as_secs().to_string()),
        }
    }

    /// As `name=value` pairs for a link, empty fields left out.
    pub(crate) fn pairs(&self) -> Vec<(&'static str, String)> {
        [
            ("state", &self.state),
            ("error", &self.error),
            ("ordering_key", &self.ordering_key),
            ("min_attempts", &self.min_attempts),
            ("max_attempts", &self.max_attempts),
            ("older_than_secs", &self.older_than_secs),
            ("newer_than_secs", &self.newer_than_secs),
        ]
        .into_iter()
        .filter_map(|(name, v)| given(v).map(|v| (name, v.to_string())))
        .collect()
    }
}

/// A filter as JSON (null: no condition).
pub(crate) fn filter_json(filter: &ItemFilter) -> Value {
    json!({
        "namespace": filter.namespace,
        "state": filter.status.map(ItemStatus::as_str),
        "error": filter.error,
        "ordering_key": filter.ordering_key,
        "min_attempts": filter.min_attempts,
        "max_attempts": filter.max_attempts,
        "older_than_secs": filter.older_than.map(|d| d.as_secs()),
        "newer_than_secs": filter.newer_than.map(|d| d.as_secs()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_fields_are_no_condition_and_bad_ones_are_named() {
        let fields = FilterFields {
            state: Some("dead".into()),
            error: Some("  ".into()),
            min_attempts: Some("".into()),
            ..FilterFields::default()
        };
        let filter = fields.filter("stripe").expect("a filter");
        assert_eq!(filter.status, Some(ItemStatus::Dead));
        assert_eq!((filter.error, filter.min_attempts), (None, None));
        let bad = FilterFields {
            min_attempts: Some("three".into()),
            ..FilterFields::default()
        };
        assert!(bad
            .filter("stripe")
            .expect_err("refused")
            .contains("min_attempts"));
        let bad = FilterFields {
            state: Some("gone".into()),
            ..FilterFields::default()
        };
        assert!(bad.filter("stripe").expect_err("refused").contains("state"));
        let none = FilterFields {
            min_attempts: Some("5".into()),
            max_attempts: Some("2".into()),
            ..FilterFields::default()
        };
        assert!(none
            .filter("stripe")
            .expect_err("refused")
            .contains("no item matches"));
        assert!(FilterFields::default().filter("not a namespace|").is_err());
    }

    #[test]
    fn json_numbers_and_nulls_are_fields_too() {
        let fields: FilterFields =
            serde_json::from_str(r#"{"min_attempts": 2, "state": null, "error": "502"}"#)
                .expect("fields");
        let filter = fields.filter("stripe").expect("a filter");
        assert_eq!(
            (filter.min_attempts, filter.status, filter.error.as_deref()),
            (Some(2), None, Some("502"))
        );
        let fields: FilterFields =
            serde_urlencoded::from_str("state=dead&min_attempts=&error=a+b").expect("fields");
        let filter = fields.filter("stripe").expect("a filter");
        assert_eq!(filter.error.as_deref(), Some("a b"));
        assert_eq!(filter.min_attempts, None);
    }

    #[test]
    fn a_filter_round_trips_through_its_fields() {
        let filter = ItemFilter::new("github")
            .status(ItemStatus::Failed)
            .error("timeout")
            .ordering_key("repo/1")
            .older_than(Duration::from_secs(60));
        let again = FilterFields::of(&filter)
            .filter("github")
            .expect("a filter");
        assert_eq!(again, filter);
    }
}
