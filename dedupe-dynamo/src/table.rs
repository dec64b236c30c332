//! The store's table: creating it (and the inbox's indexes on a table from
//! before them), deleting it, and refusing a global table whose replicas
//! could each win a claim.

use std::time::{Duration, Instant};

use aws_sdk_dynamodb::error::ProvideErrorMetadata;
use aws_sdk_dynamodb::types::{
    AttributeDefinition, BillingMode, CreateGlobalSecondaryIndexAction, GlobalSecondaryIndex,
    GlobalSecondaryIndexUpdate, IndexStatus, KeySchemaElement, KeyType, Projection, ProjectionType,
    ProvisionedThroughput, ScalarAttributeType, TableStatus, TimeToLiveSpecification,
};
use dedupe_core::{Error, Result};

use crate::store::{DynamoStore, Inner};

impl DynamoStore {
    /// Checks, writing nothing, that the table exists with the inbox's
    /// indexes (a `DescribeTable`); what is missing is an
    /// `Error::InvalidConfig` saying so.
    pub async fn check_ready(&self) -> Result<()> {
        let Inner { client, table, .. } = &*self.inner;
        let described = match client.describe_table().table_name(table).send().await {
            Ok(described) => described,
            Err(e) if e.code() == Some("ResourceNotFoundException") => {
                return Err(dedupe_core::backend::missing(format!(
                    "no DynamoDB table {table}"
                )))
            }
            Err(e) => return Err(self.fail(e)),
        };
        let indexes = described
            .table()
            .map(|t| t.global_secondary_indexes())
            .unwrap_or_default();
        for index in self.inbox_indexes()? {
            if !indexes
                .iter()
                .any(|i| i.index_name() == Some(index.index_name()))
            {
                return Err(dedupe_core::backend::missing(format!(
                    "table {table} has no index {} (it is from before the inbox)",
                    index.index_name()
                )));
            }
        }
        Ok(())
    }

    /// One `Scan` page of the table's record keys (inbox items left out,
    /// one namespace's by a filter): the cursor is the last partition key
    /// the scan read, so a page may hold fewer keys than the limit and still
    /// have a next. A tool's read: it costs a full scan over all pages.
    pub async fn scan_record_keys(
        &self,
        query: &dedupe_core::backend::RecordQuery,
    ) -> Result<dedupe_core::backend::KeyPage> {
        use aws_sdk_dynamodb::types::AttributeValue;
        let Inner {
            client,
            table,
            names,
            ..
        } = &*self.inner;
        let mut scan = client
            .scan()
            .table_name(table)
            .consistent_read(true)
            .limit(query.limit.min(i32::MAX as usize) as i32);
        if let Some(after) = &query.after {
            scan = scan.exclusive_start_key(&names.partition_key, AttributeValue::S(after.clone()));
        }
        if let Some(namespace) = &query.namespace {
            scan = scan
                .filter_expression("begins_with(#pk, :ns)")
                .expression_attribute_names("#pk", &names.partition_key)
                .expression_attribute_values(":ns", AttributeValue::S(format!("{namespace}:")));
        }
        let page = scan.send().await.map_err(|e| self.fail(e))?;
        let keys = page
            .items()
            .iter()
            .filter(|item| !crate::codec::is_inbox_item(names, item))
            .filter_map(|item| match item.get(&names.partition_key) {
                Some(AttributeValue::S(pk)) => {
                    let (ns, id) = pk.split_once(':')?;
                    dedupe_core::Key::new(ns, id).ok()
                }
                _ => None,
            })
            .collect();
        let next = page
            .last_evaluated_key()
            .and_then(|k| k.get(&names.partition_key))
            .and_then(|v| v.as_s().ok())
            .cloned();
        Ok(dedupe_core::backend::KeyPage { keys, next })
    }

    /// Creates the table if it is missing (on-demand billing, partition key
    /// only, TTL on the expiry attribute) and waits until it is active. For
    /// development and tests; in production create it with infrastructure code
    /// (the README has the definition).
    pub async fn create_table_if_missing(&self) -> Result<()> {
        let Inner {
            client,
            table,
            names,
            ..
        } = &*self.inner;
        let exists = client.describe_table().table_name(table).send().await;
        if let Err(e) = exists {
            if e.code() != Some("ResourceNotFoundException") {
                return Err(self.fail(e));
            }
            let mut create = client
                .create_table()
                .table_name(table)
                .billing_mode(BillingMode::PayPerRequest)
                .key_schema(key_element(&names.partition_key, KeyType::Hash)?);
            for definition in self.attribute_definitions()? {
                create = create.attribute_definitions(definition);
            }
            for index in self.inbox_indexes()? {
                create = create.global_secondary_indexes(index);
            }
            let created = create.send().await;
            if let Err(e) = created {
                if e.code() != Some("ResourceInUseException") {
                    return Err(self.fail(e));
                }
            }
        }
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(300) {
            let described = client
                .describe_table()
                .table_name(table)
                .send()
                .await
                .map_err(|e| self.fail(e))?;
            let table_desc = described.table();
            let indexes_active = table_desc
                .map(|t| t.global_secondary_indexes())
                .unwrap_or_default()
                .iter()
                .all(|i| i.index_status() == Some(&IndexStatus::Active));
            if table_desc.and_then(|t| t.table_status()) == Some(&TableStatus::Active)
                && indexes_active
            {
                let missing = self.inbox_indexes()?.into_iter().find(|index| {
                    !table_desc
                        .map(|t| t.global_secondary_indexes())
                        .unwrap_or_default()
                        .iter()
                        .any(|i| i.index_name() == Some(index.index_name()))
                });
                if let Some(index) = missing {
                    // A table from before the inbox: add its indexes, one
                    // at a time (DynamoDB builds one per UpdateTable).
                    self.add_index(index, table_desc).await?;
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
                let ttl = client
                    .update_time_to_live()
                    .table_name(table)
                    .time_to_live_specification(
                        TimeToLiveSpecification::builder()
                            .enabled(true)
                            .attribute_name(&names.expires_at)
                            .build()
                            .map_err(|e| Error::config(e.to_string()))?,
                    )
                    .send()
                    .await;
                match ttl {
                    Ok(_) => return Ok(()),
                    // "TimeToLive is already enabled".
                    Err(e) if e.code() == Some("ValidationException") => return Ok(()),
                    Err(e) => return Err(self.fail(e)),
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Err(Error::unavailable(
            format!("table {table} and its indexes did not become active within 300 s"),
            None,
        ))
    }

    /// The definitions of the attributes the table and its indexes key on.
    fn attribute_definitions(&self) -> Result<Vec<AttributeDefinition>> {
        let names = &self.inner.names;
        [
            (&names.partition_key, ScalarAttributeType::S),
            (&names.queue, ScalarAttributeType::S),
            (&names.deadline, ScalarAttributeType::N),
            (&names.list_namespace, ScalarAttributeType::S),
            (&names.list_key, ScalarAttributeType::S),
        ]
        .into_iter()
        .map(|(name, kind)| {
            AttributeDefinition::builder()
                .attribute_name(name)
                .attribute_type(kind)
                .build()
                .map_err(|e| Error::config(e.to_string()))
        })
        .collect()
    }

    /// The inbox's two sparse indexes, keys only (see `inbox.rs`).
    fn inbox_indexes(&self) -> Result<Vec<GlobalSecondaryIndex>> {
        let names = &self.inner.names;
        [
            (crate::inbox::DUE_INDEX, &names.queue, &names.deadline),
            (
                crate::inbox::ITEMS_INDEX,
                &names.list_namespace,
                &names.list_key,
            ),
        ]
        .into_iter()
        .map(|(index, hash, range)| {
            GlobalSecondaryIndex::builder()
                .index_name(index)
                .key_schema(key_element(hash, KeyType::Hash)?)
                .key_schema(key_element(range, KeyType::Range)?)
                .projection(
                    Projection::builder()
                        .projection_type(ProjectionType::KeysOnly)
                        .build(),
                )
                .build()
                .map_err(|e| Error::config(e.to_string()))
        })
        .collect()
    }

    /// Adds `index` to an existing table (a table made before the inbox). A
    /// table with provisioned capacity gives the index the table's own.
    async fn add_index(
        &self,
        index: GlobalSecondaryIndex,
        table: Option<&aws_sdk_dynamodb::types::TableDescription>,
    ) -> Result<()> {
        let mut create = CreateGlobalSecondaryIndexAction::builder()
            .index_name(index.index_name())
            .set_key_schema(Some(index.key_schema().to_vec()))
            .set_projection(index.projection().cloned());
        let provisioned = table
            .and_then(|t| t.provisioned_throughput())
            .and_then(|p| Some((p.read_capacity_units()?, p.write_capacity_units()?)))
            .filter(|(r, w)| *r > 0 && *w > 0);
        if let Some((read, write)) = provisioned {
            create = create.provisioned_throughput(
                ProvisionedThroughput::builder()
                    .read_capacity_units(read)
                    .write_capacity_units(write)
                    .build()
                    .map_err(|e| Error::config(e.to_string()))?,
            );
        }
        let mut update = self
            .inner
            .client
            .update_table()
            .table_name(&self.inner.table)
            .global_secondary_index_updates(
                GlobalSecondaryIndexUpdate::builder()
                    .create(create.build().map_err(|e| Error::config(e.to_string()))?)
                    .build(),
            );
        // The definitions of the table's key and of this index's keys only:
        // DynamoDB refuses definitions no key uses yet.
        let used: Vec<&str> = std::iter::once(self.inner.names.partition_key.as_str())
            .chain(index.key_schema().iter().map(|k| k.attribute_name()))
            .collect();
        for definition in self.attribute_definitions()? {
            if used.contains(&definition.attribute_name()) {
                update = update.attribute_definitions(definition);
            }
        }
        match update.send().await {
            Ok(_) => Ok(()),
            // Another process added it first.
            Err(e) if e.code() == Some("ResourceInUseException") => Ok(()),
            Err(e) => Err(self.fail(e)),
        }
    }

    /// Deletes the table and every record in it (for tests and temporary
    /// tables; needs `dynamodb:DeleteTable`). A missing table is not an error.
    pub async fn delete_table(&self) -> Result<()> {
        match self
            .inner
            .client
            .delete_table()
            .table_name(&self.inner.table)
            .send()
            .await
        {
            Ok(_) => Ok(()),
            Err(e) if e.code() == Some("ResourceNotFoundException") => Ok(()),
            Err(e) => Err(self.fail(e)),
        }
    }
}

/// Why claims are refused on `table`, if they are: a global table whose
/// replicas are not strongly consistent, unless `allowed`.
pub(crate) fn global_table_refusal(
    table: &aws_sdk_dynamodb::types::TableDescription,
    allowed: bool,
) -> Option<String> {
    use aws_sdk_dynamodb::types::MultiRegionConsistency;
    let regions: Vec<&str> = table
        .replicas()
        .iter()
        .filter_map(|r| r.region_name())
        .collect();
    let strong = table.multi_region_consistency() == Some(&MultiRegionConsistency::Strong);
    (!regions.is_empty() && !strong && !allowed).then(|| {
        format!(
            "table {} is a global table replicated to {} with eventually consistent replicas: a \
             conditional write is atomic in one region only, so two regions can each win a \
             claim of one key; use multi-region strong consistency, or write to one region \
             only and open with allow_global_table(true)",
            table.table_name().unwrap_or("?"),
            regions.join(", ")
        )
    })
}

fn key_element(name: &str, kind: KeyType) -> Result<KeySchemaElement> {
    KeySchemaElement::builder()
        .attribute_name(name)
        .key_type(kind)
        .build()
        .map_err(|e| Error::config(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn eventually_consistent_global_tables_are_refused_unless_allowed() {
        use aws_sdk_dynamodb::types::{
            MultiRegionConsistency, ReplicaDescription, TableDescription,
        };
        let plain = TableDescription::builder().table_name("t").build();
        assert_eq!(global_table_refusal(&plain, false), None);
        let global = TableDescription::builder()
            .table_name("t")
            .replicas(
                ReplicaDescription::builder()
                    .region_name("eu-west-1")
                    .build(),
            )
            .replicas(
                ReplicaDescription::builder()
                    .region_name("us-east-1")
                    .build(),
            )
            .build();
        let refusal = global_table_refusal(&global, false).expect("refused");
        assert!(refusal.contains("eu-west-1, us-east-1"), "{refusal}");
        assert_eq!(global_table_refusal(&global, true), None);
        let strong = TableDescription::builder()
            .table_name("t")
            .replicas(
                ReplicaDescription::builder()
                    .region_name("eu-west-1")
                    .build(),
            )
            .multi_region_consistency(MultiRegionConsistency::Strong)
            .build();
        assert_eq!(global_table_refusal(&strong, false), None);
    }
}
