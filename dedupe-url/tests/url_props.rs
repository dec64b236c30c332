//! Hostile store URLs: arbitrary text never panics the parser, every refusal is
//! a typed `UrlError`, and a password never shows in what is displayed, in a
//! URL that parses or in the error of one that does not.

use dedupe_url::{StoreUrl, UrlError};
use proptest::prelude::*;

fn schemes() -> impl Strategy<Value = &'static str> {
    prop_oneof![
        Just("memory:"),
        Just("sqlite:"),
        Just("sqlite://"),
        Just("sqlite:///"),
        Just("postgres://"),
        Just("postgresql://"),
        Just("redis://"),
        Just("rediss://"),
        Just("redis+cluster://"),
        Just("rediss+cluster://"),
        Just("dynamodb://"),
        Just("http://"),
        Just(""),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1024))]

    #[test]
    fn any_text_parses_or_is_refused_with_a_type(text in "\\PC{0,120}") {
        match text.parse::<StoreUrl>() {
            Ok(url) => prop_assert!(!url.to_string().is_empty()),
            Err(e) => prop_assert!(!e.to_string().is_empty()),
        }
    }

    #[test]
    fn url_shaped_text_never_panics(
        scheme in schemes(),
        body in "[a-zA-Z0-9@:/._%~;' \"-]{0,60}",
        query in proptest::collection::vec(
            ("(table|schema|prefix|connections|timeout|lease|retention|region|endpoint|sslmode|x)",
             "[a-zA-Z0-9%;' \"._:/-]{0,20}"),
            0..4,
        ),
    ) {
        let query: Vec<String> = query.into_iter().map(|(k, v)| format!("{k}={v}")).collect();
        let text = if query.is_empty() {
            format!("{scheme}{body}")
        } else {
            format!("{scheme}{body}?{}", query.join("&"))
        };
        let _ = text.parse::<StoreUrl>();
    }

    #[test]
    fn passwords_never_show(
        scheme in prop_oneof![Just("postgres"), Just("redis"), Just("rediss")],
        password in "[A-Za-z0-9]{12,24}",
        rest in prop_oneof![Just(""), Just("?timeout=2s"), Just("?bogus=1"), Just("?timeout=nonsense")],
    ) {
        let text = format!("{scheme}://user:{password}@127.0.0.1:5432/0{rest}");
        match text.parse::<StoreUrl>() {
            Ok(url) => prop_assert!(!url.to_string().contains(&password), "{url}"),
            Err(e) => {
                let e: UrlError = e;
                prop_assert!(!e.to_string().contains(&password), "{e}");
            }
        }
    }
}
